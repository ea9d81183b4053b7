duet_add_test(test_chat_template SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_chat_template.cpp LIBS duet_runtime)

# render_chat_template: the renderer as a JSON-lines filter, for tests/tools/jinja_differential.py.
add_executable(render_chat_template ${CMAKE_CURRENT_LIST_DIR}/tools/render_chat_template.cpp)
target_link_libraries(render_chat_template PRIVATE duet_runtime duet_warnings)
