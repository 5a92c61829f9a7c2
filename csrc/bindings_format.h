// The bindings' error messages, built without std::ostream's number formatting.
//
// Why: torch's TORCH_CHECK streams each message piece into a std::ostringstream, and the number overloads of
// operator<< are template code instantiated inside this extension.  Built by a newer g++ than the one that built
// torch, that inline code meets the older libstdc++'s locale facets at run time and segfaults (seen on an H200
// machine: g++ 13 against torch 2.11's wheel, every error message holding an integer).  Here integers go through
// std::to_string, floats through snprintf and shapes through both, so the message reaches torch as one
// std::string; strings, dtypes and devices were never a problem (their formatting is out-of-line torch code or a
// plain copy).  Use PYLLM_CHECK_VALUE / _TYPE / _INDEX / _NOT_IMPLEMENTED with TORCH_CHECK's arguments.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace pyllm {
namespace msg {

inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string piece(T v) {
    return std::to_string(v);
}
inline std::string piece(double v) {
    char b[40];
    std::snprintf(b, sizeof b, "%g", v);  // as std::ostream prints a double by default
    return b;
}
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string piece(const c10::Device& d) { return d.str(); }
inline std::string piece(c10::IntArrayRef a) {
    std::string s = "[";
    for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
    return s + "]";
}

template <class... A>
std::string cat(const A&... a) {
    std::string s;
    ((s += piece(a)), ...);
    return s;
}

}  // namespace msg
}  // namespace pyllm

#define PYLLM_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::pyllm::msg::cat(__VA_ARGS__))
#define PYLLM_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::pyllm::msg::cat(__VA_ARGS__))
#define PYLLM_CHECK_INDEX(cond, ...) TORCH_CHECK_INDEX(cond, ::pyllm::msg::cat(__VA_ARGS__))
#define PYLLM_CHECK_NOT_IMPLEMENTED(cond, ...) TORCH_CHECK_NOT_IMPLEMENTED(cond, ::pyllm::msg::cat(__VA_ARGS__))
