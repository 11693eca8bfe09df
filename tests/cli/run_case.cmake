# One `msaidx` command-line case: runs TOOL with ARGS (a list separated by '|'), and checks its exit
# status (RC), that its output (stdout and stderr together) matches MATCH, and, with JSON_FILE, that
# the file it wrote parses as JSON and that JSON_KEY (a path of keys, '|' apart) is of JSON_TYPE
# (NULL, NUMBER, STRING, ... as string(JSON TYPE) names them).
string(REPLACE "|" ";" arguments "${ARGS}")
if(JSON_FILE)
  file(REMOVE "${JSON_FILE}")
endif()
execute_process(COMMAND "${TOOL}" ${arguments} RESULT_VARIABLE status OUTPUT_VARIABLE out
                ERROR_VARIABLE out TIMEOUT 300)
if(NOT status STREQUAL "${RC}")
  message(FATAL_ERROR "msaidx ${ARGS}: exit status ${status}, expected ${RC}; output:\n${out}")
endif()
if(MATCH AND NOT out MATCHES "${MATCH}")
  message(FATAL_ERROR "msaidx ${ARGS}: output does not match '${MATCH}':\n${out}")
endif()
if(JSON_FILE)
  file(READ "${JSON_FILE}" json)
  string(JSON kind ERROR_VARIABLE parse_error TYPE "${json}")
  if(parse_error)
    message(FATAL_ERROR "${JSON_FILE} is not JSON: ${parse_error}\n${json}")
  endif()
  string(REPLACE "|" ";" key_path "${JSON_KEY}")
  string(JSON type ERROR_VARIABLE key_error TYPE "${json}" ${key_path})
  if(key_error OR NOT type STREQUAL "${JSON_TYPE}")
    message(FATAL_ERROR "${JSON_FILE}: ${JSON_KEY} is ${type} ${key_error}, expected ${JSON_TYPE}")
  endif()
endif()
