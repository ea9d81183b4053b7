# Byte-level BPE tokenizer: PCRE2 for the split regexes, utf8proc for the normalizers.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
target_sources(duet_runtime PRIVATE ${CMAKE_CURRENT_LIST_DIR}/tokenizer.cpp)
target_link_libraries(duet_runtime PRIVATE PkgConfig::PCRE2 PkgConfig::UTF8PROC)
