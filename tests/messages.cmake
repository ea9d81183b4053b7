# The wire format: codec tests, the decoder fuzzer, and the Python client's encoding check.
duet_add_test(test_messages SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_messages.cpp LIBS duet_messages)

# decode_frames: the C++ codec as a filter over length-prefixed frames (tests/tools/).
add_executable(decode_frames ${CMAKE_CURRENT_LIST_DIR}/tools/decode_frames.cpp)
target_link_libraries(decode_frames PRIVATE duet_messages nlohmann_json::nlohmann_json duet_warnings)

# What scripts/duet_client.py encodes, the C++ codec decodes, and the other way round.
if(EXISTS /usr/bin/python3)
  add_test(NAME python_encoding_matches_codec
           COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/tools/check_python_encoding.py
                   $<TARGET_FILE:decode_frames>)
  set_tests_properties(python_encoding_matches_codec PROPERTIES TIMEOUT 120)
endif()

# The decoder fuzzer needs clang with the libFuzzer runtime (Debian: clang, libclang-rt-14-dev).
find_program(DUET_CLANGXX clang++)
if(DUET_CLANGXX)
  execute_process(COMMAND ${DUET_CLANGXX} -print-file-name=libclang_rt.fuzzer-x86_64.a
                  OUTPUT_VARIABLE DUET_LIBFUZZER OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
if(DUET_CLANGXX AND DUET_LIBFUZZER AND EXISTS "${DUET_LIBFUZZER}")
  add_test(NAME fuzz_decode COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/fuzz.sh 20)
  set_tests_properties(fuzz_decode PROPERTIES TIMEOUT 900 LABELS fuzz
                       ENVIRONMENT "CXX_FUZZ=${DUET_CLANGXX}")
else()
  message(STATUS "fuzz_decode: skipped (needs clang++ and libclang_rt.fuzzer-x86_64.a)")
endif()
