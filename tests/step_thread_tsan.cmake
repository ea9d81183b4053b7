# runtime/step_thread.cpp built with ThreadSanitizer on its own (the rest of the runtime is not):
# the race check of the thread a prefill worker computes its steps on.
add_executable(step_thread_tsan ${CMAKE_CURRENT_LIST_DIR}/step_thread_tsan.cpp
  ${PROJECT_SOURCE_DIR}/runtime/step_thread.cpp)
target_include_directories(step_thread_tsan PRIVATE ${PROJECT_SOURCE_DIR})
target_compile_options(step_thread_tsan PRIVATE -fsanitize=thread -g -O1)
target_link_options(step_thread_tsan PRIVATE -fsanitize=thread)
target_link_libraries(step_thread_tsan PRIVATE Threads::Threads duet_warnings)
add_test(NAME step_thread_tsan COMMAND step_thread_tsan)

# decode_core's steps on that thread, with the engine calls it holds back for the step's end:
# the core and what it needs built with ThreadSanitizer too (the rest of duet_runtime, linked
# for what is left, such as make_block_manager, and the message codec are not).
find_path(DUET_TSAN_XXHASH_INCLUDE xxhash.h REQUIRED)
find_library(DUET_TSAN_XXHASH xxhash REQUIRED)
add_executable(decode_thread_tsan ${CMAKE_CURRENT_LIST_DIR}/decode_thread_tsan.cpp
  ${PROJECT_SOURCE_DIR}/runtime/decode_core.cpp ${PROJECT_SOURCE_DIR}/runtime/step_thread.cpp
  ${PROJECT_SOURCE_DIR}/runtime/block_manager.cpp ${PROJECT_SOURCE_DIR}/runtime/kv_arena.cpp
  ${PROJECT_SOURCE_DIR}/runtime/kv_pool_share.cpp ${PROJECT_SOURCE_DIR}/runtime/kv_stream.cpp)
target_include_directories(decode_thread_tsan PRIVATE ${PROJECT_SOURCE_DIR} ${DUET_TSAN_XXHASH_INCLUDE})
target_compile_options(decode_thread_tsan PRIVATE -fsanitize=thread -g -O1)
target_link_options(decode_thread_tsan PRIVATE -fsanitize=thread)
target_link_libraries(decode_thread_tsan PRIVATE duet_runtime ${DUET_TSAN_XXHASH} Threads::Threads duet_warnings)
add_test(NAME decode_thread_tsan COMMAND decode_thread_tsan)
