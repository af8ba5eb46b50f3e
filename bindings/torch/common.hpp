// Shared conversions of the torch front (common.cpp): tensors to RoME views, rotations, tables,
// and RoME errors to Python exceptions.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rome/rome.hpp"

namespace rome_torch {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Rethrows as ValueError / IndexError / NotImplementedError with the core's message.
[[noreturn]] void rethrow(const rome::Error& e);
std::string shape_of(const Tensor& t);
rome::ConstTensorView const_view(const Tensor& t, const char* name, bool integer);
rome::TensorView mutable_view(const Tensor& t, const char* name);
rome::ConstTensorView const_view(const Tensor& t, const std::string& name, bool integer);
rome::TensorView mutable_view(const Tensor& t, const std::string& name);
Tensor readable(const Tensor& t);
Tensor alloc_like(const Tensor& t);
rome::Rotation build_rotation(const std::string& kind, const std::vector<int64_t>& blocks,
                              int64_t rotary_dim, int64_t head_dim, const OptTensor& mat_a,
                              const OptTensor& mat_b, const std::string& mat_b_name,
                              int64_t lane_offset = 0);
std::pair<Tensor, Tensor> effective_tables(const Tensor& cos, const Tensor& sin,
                                           c10::IntArrayRef x_sizes);
// Threads as torch has them (at::parallel_for, torch.set_num_threads), unless the user asked
// RoME for a count (rome.set_num_threads, ROME_NUM_THREADS): then RoME's own pool.
rome::ExecOptions exec_options();
// Keeps the tensors the views point into alive.
struct PreparedTables {
  rome::Tables tables;
  Tensor cos, sin, positions;
};
PreparedTables prepare_tables(const Tensor& cos, const Tensor& sin, const OptTensor& positions,
                              const std::string& width, const std::vector<int64_t>& column_axis,
                              c10::IntArrayRef x_sizes);

// inv_freq (1-D, any float dtype, on positions' device) read exactly as doubles.
std::vector<double> frequencies_of(const Tensor& inv_freq, const Tensor& positions);
// Table-free tables: positions (leading axes added as needed) and inv_freq read as doubles.
PreparedTables table_free_tables(const Tensor& positions, const Tensor& inv_freq, double amplitude,
                                 const std::vector<int64_t>& column_axis, c10::IntArrayRef x_sizes,
                                 bool inverse);

}  // namespace rome_torch
