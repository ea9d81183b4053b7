# Jinja chat templates (runtime/chat_template.cpp). utf8proc gives Python's character classes
# and case mappings; its own prefix keeps it independent of the tokenizer fragment.
pkg_check_modules(DUET_CHAT_TEMPLATE_UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/chat_template.cpp)
target_link_libraries(duet_runtime PRIVATE PkgConfig::DUET_CHAT_TEMPLATE_UTF8PROC)
