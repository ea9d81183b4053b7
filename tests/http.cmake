# The HTTP front end: C++ unit tests of the API's pure parts, and the end-to-end test with
# the official openai SDK against `duet up` (needs the venv of the README's test command).
duet_add_test(test_http SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_http.cpp LIBS duet_runtime)
set(DUET_PYTHON ${PROJECT_SOURCE_DIR}/.venv/bin/python)
add_test(NAME http_openai COMMAND ${DUET_PYTHON} -m pytest -q ${CMAKE_CURRENT_LIST_DIR}/http)
set_tests_properties(http_openai PROPERTIES ENVIRONMENT "DUET_BIN=$<TARGET_FILE:duet>" TIMEOUT 600 LABELS http)
