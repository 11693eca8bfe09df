#!/usr/bin/env bash
# Counts, per kernel of a CUDA binary, the tensor-core instructions (HGMMA: FP16/BF16 wgmma,
# QGMMA: FP8 wgmma, HMMA: mma.sync) and local-memory accesses (LDL/STL: spills). Needs cuobjdump.
# usage: bench/sass_summary.sh build/libmsaidx.so [kernel-name-filter]
set -euo pipefail
binary=$1 filter=${2:-.}
cuobjdump -sass "$binary" | awk -v filter="$filter" '
    /Function :/ { kernel = $3; if (kernel ~ filter) seen[kernel] = 1; next }
    kernel !~ filter { next }
    { for (i = 1; i <= NF; ++i) {
          op = $i; sub(/\..*/, "", op)
          if (op ~ /^(HGMMA|QGMMA|HMMA|LDL|STL)$/) { count[kernel " " op]++; break }
      } }
    END {
        for (k in seen) {
            line = k ":"
            n = split("HGMMA QGMMA HMMA LDL STL", ops, " ")
            for (j = 1; j <= n; ++j) line = line " " ops[j] "=" (count[k " " ops[j]] + 0)
            print line
        }
    }'
