# Compiles a wgmma translation unit with ptxas's verbose notes and fails when ptxas serializes any
# wgmma in it ("wgmma.mma_async instructions are serialized", notes C7510-C7520). Those are info
# lines, not warnings, so -Werror cannot catch them, and a serialized pipeline still computes the
# right scores, so no device test can either: the persistent scorer then runs several times
# slower. Run by ctest (tests/CMakeLists.txt) with NVCC, SOURCE, INCLUDES (;-list), DEFINES
# (;-list), ARCH and KERNELS (how many kernels the unit must compile).
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
          -o ${CMAKE_CURRENT_BINARY_DIR}/ptxas_wgmma_check.o
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
