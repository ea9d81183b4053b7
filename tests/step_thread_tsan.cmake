# runtime/step_thread.cpp built with ThreadSanitizer on its own (the rest of the runtime is not):
# the race check of the thread a prefill worker computes its steps on.
add_executable(step_thread_tsan ${CMAKE_CURRENT_LIST_DIR}/step_thread_tsan.cpp
  ${PROJECT_SOURCE_DIR}/runtime/step_thread.cpp)
target_include_directories(step_thread_tsan PRIVATE ${PROJECT_SOURCE_DIR})
target_compile_options(step_thread_tsan PRIVATE -fsanitize=thread -g -O1)
target_link_options(step_thread_tsan PRIVATE -fsanitize=thread)
target_link_libraries(step_thread_tsan PRIVATE Threads::Threads duet_warnings)
add_test(NAME step_thread_tsan COMMAND step_thread_tsan)
