// The message of the faceshard::Error a call throws, for tests of bad input (header-only:
// the AddressSanitizer target uses it too, linking no faceshard library).
#pragma once
#include <functional>
#include <string>

#include "base/error.h"

namespace faceshard::testing {

// "<no error>" when `f` returns normally; any other exception propagates.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace faceshard::testing
