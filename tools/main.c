/* msaidx: run the indexer on a realistic batch, benchmark its backends, check its accuracy. */
#include "tool.h"

#include <stdio.h>
#include <string.h>

static void usage(FILE *out) {
    fprintf(
        out,
        "usage: msaidx <command> [options]   (msaidx <command> --help for its options)\n"
        "\n"
        "commands:\n"
        "  run     score + top-k select a MiniMax-M3-like ragged prefill batch on the GPU if\n"
        "          there is one (else the CPU), check sampled rows against an FP64 reference,\n"
        "          print time and throughput; exits non-zero when the check fails\n"
        "  bench   time the backends on a shapes file (bench/shapes/prefill78.tsv by default)\n"
        "          with JSON and Markdown output; on a GPU also the FP8 GEMM and copy ceilings\n"
        "  check   accuracy: exactness vs FP64, top-16 recall of E4M3/BF16 storage vs FP32,\n"
        "          needle retrieval\n"
        "  e2e     the indexer's time per forward step of a MiniMax-M3-like model (57 layers of\n"
        "          one prefill chunk + decode rows, one CUDA graph) per backend; needs a GPU\n"
        "  version print the library version and the backends compiled in\n");
}

static int cmd_version(void) {
    printf("msaidx %d.%d.%d\nbackends compiled in:", MSAIDX_VERSION_MAJOR, MSAIDX_VERSION_MINOR,
           MSAIDX_VERSION_PATCH);
    msaidx_config config;
    msaidx_config_init(&config);
    for (int b = MSAIDX_BACKEND_CPU; b <= MSAIDX_BACKEND_PERSISTENT; ++b) {
        config.device = b == MSAIDX_BACKEND_CPU ? MSAIDX_DEVICE_HOST : 0;
        msaidx_status status = msaidx_backend_supported((msaidx_backend)b, &config);
        const bool compiled_out =
            status != MSAIDX_SUCCESS && strstr(msaidx_last_error(), "not compiled");
        if (!compiled_out) printf(" %s", msaidx_backend_name((msaidx_backend)b));
    }
    printf("\n");
    const tool_exec *gpu = tool_pick_gpu();
    if (gpu) {
        printf("device: %s\n", gpu->name);
    } else {
        char why[512];
        tool_no_gpu_reason(MSAIDX_BACKEND_AUTO, why, sizeof why);
        printf("device: none, cpu backend only (%s)\n", why);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    const char *command = argv[1];
    if (!strcmp(command, "run")) return cmd_run(argc - 1, argv + 1);
    if (!strcmp(command, "bench")) return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(command, "check")) return cmd_check(argc - 1, argv + 1);
    if (!strcmp(command, "e2e")) return cmd_e2e(argc - 1, argv + 1);
    if (!strcmp(command, "version") || !strcmp(command, "--version")) {
        if (argc > 2 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) {
            printf("usage: msaidx version\n\nPrints the library version, the backends compiled "
                   "in and the CUDA device found, or why none is usable.\n");
            return 0;
        }
        if (argc > 2) {
            fprintf(stderr, "msaidx version: takes no options (got %s)\n", argv[2]);
            return 2;
        }
        return cmd_version();
    }
    fprintf(stderr, "msaidx: unknown command '%s'\n\n", command);
    usage(stderr);
    return 2;
}
