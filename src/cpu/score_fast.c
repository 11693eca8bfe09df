/* Fast cpu scorer. Placeholder wiring: runs the reference until the SIMD path lands. */
#include "cpu.h"

const char *msaidx_cpu_simd_name(void) { return "scalar"; }

void msaidx_cpu_scores_fast(const msaidx_cpu_batch *batch) { msaidx_cpu_scores_reference(batch); }
