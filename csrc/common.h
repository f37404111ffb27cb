// Error handling shared by every native source: one exception type carrying
// file:line (and TimeoutError, the one subtype a caller handles differently: a
// deadline passed), and CHECK macros that format the failing condition.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace llamarl {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Raised only after the operation that missed its deadline has stopped (nothing
// it started is left running): the Python side maps it to SyncTimeoutError.
class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& what) : Error(what) {}
};

template <typename E = Error>
[[noreturn]] void throw_error(const char* file, int line, const std::string& msg) {
  std::ostringstream out;
  out << msg << " (" << file << ":" << line << ")";
  throw E(out.str());
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

#define LLAMARL_THROW(ErrorType, msg)                                            \
  do {                                                                         \
    std::ostringstream llamarl_msg_;                                           \
    llamarl_msg_ << msg;                                                       \
    ::llamarl::throw_error<ErrorType>(__FILE__, __LINE__, llamarl_msg_.str()); \
  } while (0)
