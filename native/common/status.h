// Shared conventions of the native core, and Status, the error it returns.
//
// Rows are row-major float32: element j of row i of a pool is pool[i * width + j], where
// width = embedding_dim + optimizer-state floats (weights ‖ state).
// Ids are int64 in [0, num_embeddings); slots are int64 in [0, capacity + overflow_limit).
// Errors inside the core are return values (Status); the bindings (common/bindings.h) turn them
// into Python exceptions whose message names the bad value.
// Thread-safety: one writer per object; every call runs to completion before the next.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace tieredemb {

struct Status {
  enum Code { kOk = 0, kIndexError, kValueError, kRuntimeError };
  Code code = kOk;
  std::string message;

  static Status Ok() { return {}; }
  static Status IndexError(std::string m) { return {kIndexError, std::move(m)}; }
  static Status ValueError(std::string m) { return {kValueError, std::move(m)}; }
  static Status RuntimeError(std::string m) { return {kRuntimeError, std::move(m)}; }
  bool ok() const { return code == kOk; }
};

}  // namespace tieredemb
