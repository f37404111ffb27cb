// Error handling shared by every native source: one exception type carrying
// file:line, and CHECK macros that format the failing condition.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace llamarl {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] inline void throw_error(const char* file, int line, const std::string& msg) {
  std::ostringstream out;
  out << msg << " (" << file << ":" << line << ")";
  throw Error(out.str());
}

}  // namespace llamarl

#define LLAMARL_CHECK(cond, msg)                                  \
  do {                                                            \
    if (!(cond)) {                                                \
      std::ostringstream llamarl_msg_;                            \
      llamarl_msg_ << msg;                                        \
      ::llamarl::throw_error(__FILE__, __LINE__, llamarl_msg_.str()); \
    }                                                             \
  } while (0)
