// Shared by the per-dispatch-key files of the rome:: operators (schemas.cpp, cpu.cpp, meta.cpp,
// autograd.cpp): RoME errors mapped to the op's argument names, small tensor helpers, and typed
// handles for redispatch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/SymInt.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common.hpp"

namespace rome_torch {

template <typename F>
decltype(auto) guarded(F&& f) {
  try {
    return f();
  } catch (const rome::Error& e) {
    rethrow(e);
  }
}

// The core names its operands q, q_out, k, k_out, cos, sin; an op whose arguments are called
// otherwise (x, query, key, cos_sin_cache) or that passes q as its own output (in place) maps
// each role to its own argument, so every message names an argument of the op the user called
// (a whole name, "frequencies" -> "inv_freq", or the part before a dot: "q.dtype" -> "x.dtype").
using Renames = std::initializer_list<std::pair<const char*, const char*>>;

template <typename F>
decltype(auto) guarded(Renames renames, F&& f) {
  try {
    return f();
  } catch (const rome::Error& e) {
    const std::string& arg = e.argument();
    const std::string base = arg.substr(0, arg.find('.')), suffix = arg.substr(base.size());
    for (const auto& [from, to] : renames) {
      if (arg == from) rethrow(e.about(to));
      if (base == from) rethrow(e.about(to + suffix));
    }
    rethrow(e);
  }
}

inline bool has(const OptTensor& t) {
  return t.has_value() && t->defined();
}

inline std::vector<int64_t> to_vec(c10::IntArrayRef a) {
  return std::vector<int64_t>(a.begin(), a.end());
}

inline Tensor empty_marker(const Tensor& like) {
  return at::empty({0}, like.options());
}

// Every operand goes through the core with a rank of at least 2; name it in errors first.
inline int64_t head_dim_of(const Tensor& x, const char* name) {
  if (x.dim() < 2 || x.dim() > rome::kMaxRank)
    rome::fail(rome::Status::invalid_argument, name, "rank 2 to 5 with the head dimension last",
               "rank " + std::to_string(x.dim()) + " " + shape_of(x));
  return x.size(-1);
}

// ----------------------------------------------------------------------------------------------
// Typed handles (for redispatch from Autograd / ADInplaceOrView and for backward).

using RopeSig = std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&,
                                           const Tensor&, const OptTensor&, c10::string_view,
                                           c10::IntArrayRef, int64_t, c10::string_view,
                                           c10::IntArrayRef, const OptTensor&, const OptTensor&);
using RopeInplaceSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                            const OptTensor&, c10::string_view, c10::IntArrayRef, int64_t,
                            c10::string_view, c10::IntArrayRef, const OptTensor&, const OptTensor&);
using RopeOutSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                        const Tensor&, const OptTensor&, const OptTensor&, c10::string_view,
                        c10::IntArrayRef, int64_t, c10::string_view, c10::IntArrayRef,
                        const OptTensor&, const OptTensor&);
using RopeMatrixSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using RopeMatrixInplaceSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using RotaryEmbeddingSig = void(const Tensor&, const Tensor&, const OptTensor&, int64_t,
                                const Tensor&, bool, int64_t, bool);
using FusedQkNormRopeSig = void(const Tensor&, int64_t, int64_t, int64_t, int64_t, double,
                                const Tensor&, const Tensor&, const Tensor&, bool, const Tensor&,
                                bool);
using RopeWithCacheSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                              const Tensor&, bool, const Tensor&, const Tensor&, const Tensor&,
                              const OptTensor&, const OptTensor&, double, bool);
using RerotatePagedSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, c10::string_view, int64_t);
using InterleavedSig = Tensor(const Tensor&, const Tensor&);
using FromPositionsSig = std::tuple<Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&,
                                                    const Tensor&, c10::string_view,
                                                    c10::IntArrayRef, int64_t, double,
                                                    c10::IntArrayRef, bool);
using FromPositionsInplaceSig = void(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                     c10::string_view, c10::IntArrayRef, int64_t, double,
                                     c10::IntArrayRef, bool);
using BackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const OptTensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
    const OptTensor&, c10::string_view, c10::IntArrayRef, int64_t, c10::string_view,
    c10::IntArrayRef, const OptTensor&, const OptTensor&, std::array<bool, 6>);

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
#define ROME_OP(var, name, Sig) static const auto var = handle<Sig>(name)

// ExecuTorch: x [B, N, C], freqs_cis with N*C elements, (cos, sin) pairs innermost.
inline std::pair<Tensor, Tensor> interleaved_tables(const Tensor& freqs, c10::SymInt n,
                                                    c10::SymInt c) {
  const Tensor pairs = freqs.reshape_symint({n, c / 2, 2});
  return {pairs.select(2, 0), pairs.select(2, 1)};
}

}  // namespace rome_torch
