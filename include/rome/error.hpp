// Errors raised by every public entry point of RoME.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace rome {

// Status codes mirror the exception categories so a C boundary can report them.
enum class Status : int {
  ok = 0,
  invalid_argument = 1,  // a shape, dtype, stride or value is not what the operation accepts
  out_of_range = 2,      // a position lies outside the cache, or a size overflows
  unsupported = 3,       // valid input that this build or CPU cannot run
  internal = 4,
};

const char* status_name(Status status) noexcept;

// Every message names the argument, what was expected and what was given:
//   "rome: cos: expected a shape broadcastable to [2, 8, 16, 64], got [3, 16, 64]"
class Error : public std::runtime_error {
 public:
  // The message is "rome: <argument>: expected <expected>, got <given>".
  Error(Status status, std::string argument, std::string expected, std::string given);

  Status status() const noexcept { return status_; }
  const std::string& argument() const noexcept { return argument_; }
  const std::string& expected() const noexcept { return expected_; }
  const std::string& given() const noexcept { return given_; }

  // The same error about an argument of another name (a binding whose arguments are called
  // otherwise than the core's operands): the message is formed anew from its parts.
  Error about(std::string argument) const {
    return Error(status_, std::move(argument), expected_, given_);
  }

 private:
  Status status_;
  std::string argument_, expected_, given_;
};

// Throws Error(status, argument, expected, given).
[[noreturn]] void fail(Status status, const std::string& argument, const std::string& expected,
                       const std::string& given);

}  // namespace rome
