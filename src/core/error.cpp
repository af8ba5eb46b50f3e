#include "rome/error.hpp"

#include <utility>

namespace rome {

const char* status_name(Status status) noexcept {
  switch (status) {
    case Status::ok: return "ok";
    case Status::invalid_argument: return "invalid_argument";
    case Status::out_of_range: return "out_of_range";
    case Status::unsupported: return "unsupported";
    case Status::internal: return "internal";
  }
  return "unknown";
}

Error::Error(Status status, std::string argument, std::string expected, std::string given)
    : std::runtime_error("rome: " + argument + ": expected " + expected + ", got " + given),
      status_(status),
      argument_(std::move(argument)),
      expected_(std::move(expected)),
      given_(std::move(given)) {}

void fail(Status status, const std::string& argument, const std::string& expected,
          const std::string& given) {
  throw Error(status, argument, expected, given);
}

}  // namespace rome
