#include "rome/error.hpp"

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

Error::Error(Status status, std::string argument, const std::string& message)
    : std::runtime_error(message), status_(status), argument_(std::move(argument)) {}

void fail(Status status, const std::string& argument, const std::string& expected,
          const std::string& given) {
  throw Error(status, argument, "rome: " + argument + ": expected " + expected + ", got " + given);
}

}  // namespace rome
