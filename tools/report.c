/* The one place where the tool writes its result files (bench's and e2e's JSON and Markdown):
 * every failure to open, write or close a file is reported and turns into a non-zero exit. */
#include "tool.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static bool output_writable(const char *command, const char *path) {
    if (!path) return true;
    /* Appending creates nothing that is not removed again and truncates nothing, so a result
     * file of an earlier run stays intact when this run fails later. */
    const bool existed = access(path, F_OK) == 0;
    FILE *file = fopen(path, "a");
    if (!file) {
        fprintf(stderr, "msaidx %s: cannot write %s: %s\n", command, path, strerror(errno));
        return false;
    }
    fclose(file);
    if (!existed) remove(path);
    return true;
}

bool tool_outputs_writable(const char *command, const char *json_path, const char *markdown_path) {
    if (json_path && markdown_path && !strcmp(json_path, markdown_path)) {
        fprintf(stderr, "msaidx %s: --json and --markdown name the same file, %s\n", command,
                json_path);
        return false;
    }
    return output_writable(command, json_path) && output_writable(command, markdown_path);
}

bool tool_write_file(const char *command, const char *path, tool_writer write,
                     const void *context) {
    FILE *file = fopen(path, "w");
    if (!file) {
        fprintf(stderr, "msaidx %s: cannot write %s: %s\n", command, path, strerror(errno));
        return false;
    }
    write(file, context);
    const bool written = fflush(file) == 0 && !ferror(file);
    const int write_errno = errno;
    const bool closed = fclose(file) == 0;
    if (!written || !closed) {
        fprintf(stderr, "msaidx %s: writing %s failed: %s\n", command, path,
                strerror(written ? errno : write_errno));
        /* A truncated result file would read as a complete one; devices and pipes stay. */
        struct stat status;
        if (stat(path, &status) == 0 && S_ISREG(status.st_mode)) remove(path);
        return false;
    }
    printf("wrote %s\n", path);
    return true;
}

void tool_json_string(FILE *file, const char *text) {
    fputc('"', file);
    for (const unsigned char *c = (const unsigned char *)(text ? text : ""); *c; ++c) {
        if (*c == '"' || *c == '\\')
            fprintf(file, "\\%c", *c);
        else if (*c < 0x20)
            fprintf(file, "\\u%04x", *c);
        else
            fputc(*c, file);
    }
    fputc('"', file);
}

void tool_json_number(FILE *file, double value, int decimals) {
    if (isfinite(value))
        fprintf(file, "%.*f", decimals, value);
    else
        fputs("null", file);
}
