#!/usr/bin/env bash
# Compares the SASS of every kernel in two CUDA binaries (e.g. a library built before and after a
# refactor, with the same flags): per kernel "identical" or the instruction counts and the first
# differing lines. Names are compared with the anonymous-namespace tag (a hash of the file) removed,
# and instruction addresses and encodings are kept, so "identical" means the same machine code.
# Needs cuobjdump (and nvdisasm). usage: bench/sass_compare.sh before.so after.so [kernel-filter]
set -euo pipefail
before=$1 after=$2 filter=${3:-.}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
split_kernels() { # binary dir: one file per kernel, named by its normalized name, blanks squeezed
    mkdir -p "$2"
    cuobjdump -sass "$1" | awk -v dir="$2" '
        /Function :/ { name = $3; gsub(/_GLOBAL__N__[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]+/, "anon", name)
                       file = dir "/" name; next }
        /Fatbin/ { file = "" }
        file != "" && /\/\* *0x[0-9a-f]+ *\*\// { $1 = $1; print > file }'
}
split_kernels "$before" "$work/before"
split_kernels "$after" "$work/after"
status=0
for f in $(ls "$work/before" "$work/after" | grep -v ':$' | grep -v '^$' | sort -u); do
    [[ $f =~ $filter ]] || continue
    if [[ ! -f $work/before/$f ]]; then echo "only after:  $f"; status=1; continue; fi
    if [[ ! -f $work/after/$f ]]; then echo "only before: $f"; status=1; continue; fi
    if cmp -s "$work/before/$f" "$work/after/$f"; then
        echo "identical ($(wc -l < "$work/before/$f") SASS lines): $f"
    else
        echo "DIFFERS ($(wc -l < "$work/before/$f") -> $(wc -l < "$work/after/$f") SASS lines): $f"
        { diff "$work/before/$f" "$work/after/$f" || true; } | head -8 | sed 's/^/    /'
        status=1
    fi
done
exit $status
