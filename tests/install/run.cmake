# cmake -P script: install msaidx from its build tree into a prefix, build and run the consumer
# against it; then build the consumer with msaidx vendored by add_subdirectory and run it.
# The vendored library is built cpu-only (the CUDA kernels would take minutes to compile again);
# with a CUDA toolchain a configure-only run checks that vendoring keeps the persistent backend.
file(REMOVE_RECURSE ${WORK})

function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "failed (${result}): ${ARGN}\n${output}")
  endif()
  set(step_output "${output}" PARENT_SCOPE)
endfunction()

step(${CMAKE_COMMAND} --install ${MSAIDX_BUILD} --prefix ${WORK}/prefix)
step(${CMAKE_COMMAND} -S ${CONSUMER} -B ${WORK}/installed -DCMAKE_C_COMPILER=${C_COMPILER}
     -DCMAKE_PREFIX_PATH=${WORK}/prefix)
step(${CMAKE_COMMAND} --build ${WORK}/installed)
step(${WORK}/installed/consumer)
message("installed: ${step_output}")

if(HAVE_CUDA)
  step(${CMAKE_COMMAND} -S ${CONSUMER} -B ${WORK}/vendored_cuda -DCMAKE_C_COMPILER=${C_COMPILER}
       -DMSAIDX_SOURCE_DIR=${MSAIDX_SOURCE} -DMSAIDX_EXPECT_PERSISTENT=ON)
endif()
step(${CMAKE_COMMAND} -S ${CONSUMER} -B ${WORK}/vendored -DCMAKE_C_COMPILER=${C_COMPILER}
     -DMSAIDX_SOURCE_DIR=${MSAIDX_SOURCE} -DMSAIDX_CUDA=OFF)
step(${CMAKE_COMMAND} --build ${WORK}/vendored -j 2)
step(${WORK}/vendored/consumer)
message("vendored: ${step_output}")
