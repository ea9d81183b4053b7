# Fault tests: three `duet node` processes over ipc:// on a tiny random CPU checkpoint, with
# kill -9 and the transport's fault hook ($DUET_TRANSPORT_FAULT). About a minute and a half.
duet_add_test(test_faults SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_faults.cpp LIBS duet_runtime)
target_include_directories(test_faults PRIVATE ${PROJECT_SOURCE_DIR})
add_dependencies(test_faults duet)
set_tests_properties(test_faults PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE)
