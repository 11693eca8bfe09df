# Checks that ptxas kept the persistent scorer's wgmma as written:
# 1. (with SOURCE) compiles the translation unit: no wgmma serialized ("wgmma.mma_async
#    instructions are serialized", notes C7510-C7520 of ptxas -v). Those are info lines, not
#    warnings, so -Werror cannot catch them, and a serialized pipeline still computes the right
#    scores, so no device test can either: the scorer then runs several times slower;
# 2. where cuobjdump is at hand (beside nvcc, on the PATH, or $CUOBJDUMP), each kernel's count of
#    FP8 (QGMMA) and FP16/BF16 (HGMMA) wgmma in the SASS of that object or of BINARY: ptxas 13.0
#    has been seen to drop a wgmma without any note, and a dummy HGMMA in its place, when code read
#    an accumulator across a wgmma that rewrites it (bench/experiments/2026-12-01_h200_memory_bound.md);
#    the scores then come out wrong only for some pages. Without cuobjdump this part is skipped
#    (the output says so).
# ctest (tests/CMakeLists.txt) runs it with NVCC, SOURCE, INCLUDES (;-list), DEFINES (;-list), ARCH
# and KERNELS (how many kernels the unit must compile); bench/h200_run.sh with BINARY (a built
# libmsaidx.so) on the device.

# Written counts: the FP8 kernel's two loops and their tails issue 64 QGMMA; the exact E4M3 and
# BF16 kernels 24 HGMMA each. Change them with the loops.
set(wgmma_written
    "persistent_score_kernelILb1E 64 0" "persistent_score_kernelILb0E 0 24"
    "persistent_bf16_score_kernel 0 24")

if(SOURCE)
  set(args)
  foreach(dir ${INCLUDES})
    list(APPEND args "-I${dir}")
  endforeach()
  foreach(def ${DEFINES})
    list(APPEND args "-D${def}")
  endforeach()
  execute_process(
    COMMAND ${NVCC} ${args} -O3 -DNDEBUG -std=c++17 --expt-relaxed-constexpr
            "--generate-code=arch=compute_${ARCH},code=[sm_${ARCH}]" -Xptxas -v -c ${SOURCE}
            -o ${CMAKE_CURRENT_BINARY_DIR}/persistent_wgmma_check.o
    RESULT_VARIABLE status
    OUTPUT_VARIABLE output
    ERROR_VARIABLE output)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "nvcc failed on ${SOURCE}:\n${output}")
  endif()
  string(REGEX MATCHALL "[^\n]*serialized[^\n]*" serialized "${output}")
  if(serialized)
    string(REPLACE ";" "\n" serialized "${serialized}")
    message(FATAL_ERROR "ptxas serializes wgmma in ${SOURCE}:\n${serialized}")
  endif()
  string(REGEX MATCHALL "Compiling entry function" entries "${output}")
  list(LENGTH entries count)
  if(count LESS KERNELS)
    message(FATAL_ERROR "${SOURCE}: ${count} kernels compiled, expected ${KERNELS} (defines: ${DEFINES})")
  endif()
  message(STATUS "${SOURCE}: ${count} kernels, no wgmma serialized")
  set(BINARY ${CMAKE_CURRENT_BINARY_DIR}/persistent_wgmma_check.o)
  get_filename_component(nvcc_dir ${NVCC} DIRECTORY)
endif()

if(DEFINED ENV{CUOBJDUMP})
  set(cuobjdump $ENV{CUOBJDUMP})
else()
  find_program(cuobjdump cuobjdump HINTS ${nvcc_dir})
endif()
if(NOT cuobjdump)
  message(STATUS "no cuobjdump beside nvcc, on the PATH or in $CUOBJDUMP: wgmma counts not checked")
  return()
endif()
execute_process(COMMAND ${cuobjdump} -sass ${BINARY}
                RESULT_VARIABLE status OUTPUT_VARIABLE sass ERROR_VARIABLE sass_errors)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${cuobjdump} failed:\n${sass_errors}")
endif()
# One list entry per kernel (SASS lines end in ';', which CMake lists would split on).
string(REPLACE ";" "" sass "${sass}")
string(REPLACE "Function : " ";" kernels "${sass}")
foreach(expectation ${wgmma_written})
  separate_arguments(fields UNIX_COMMAND "${expectation}")
  list(GET fields 0 name)
  list(GET fields 1 want_q)
  list(GET fields 2 want_h)
  set(found FALSE)
  foreach(kernel ${kernels})
    string(REGEX MATCH "^[^\n]+" signature "${kernel}")
    string(FIND "${signature}" "${name}" at)
    if(at EQUAL -1)
      continue()
    endif()
    set(found TRUE)
    string(REGEX MATCHALL "QGMMA\\." q "${kernel}")
    string(REGEX MATCHALL "HGMMA\\." h "${kernel}")
    list(LENGTH q got_q)
    list(LENGTH h got_h)
    if(NOT got_q EQUAL want_q OR NOT got_h EQUAL want_h)
      message(FATAL_ERROR "${signature}: ${got_q} QGMMA and ${got_h} HGMMA in SASS, written with "
                          "${want_q} and ${want_h} (tests/persistent_wgmma.cmake): ptxas dropped or "
                          "added wgmma, or the loops changed and the counts with them")
    endif()
  endforeach()
  if(NOT found)
    message(FATAL_ERROR "no kernel whose name contains ${name} in ${BINARY}")
  endif()
endforeach()
message(STATUS "${BINARY}: every persistent kernel's wgmma count as written")
