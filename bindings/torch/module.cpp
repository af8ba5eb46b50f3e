// rome._C: the Python module of the extension. The operators register themselves with the
// dispatcher (schemas.cpp, cpu.cpp, meta.cpp, autograd.cpp) when this library loads; this file adds
// the non-op utilities: CPU/ISA information and control, the drop-ins' eager entries (eager.cpp),
// dense rotation matrices, and the table builders of rome/tables.hpp.
#include <torch/extension.h>

#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common.hpp"
#include "eager.hpp"

namespace {

namespace py = pybind11;
namespace rt = rome::tables;
using at::Tensor;

rome::Isa parse_isa(const std::string& name) {
  for (rome::Isa isa : {rome::Isa::scalar, rome::Isa::avx2, rome::Isa::avx512, rome::Isa::amx})
    if (name == rome::isa_name(isa)) return isa;
  rome::fail(rome::Status::invalid_argument, "isa", "one of scalar, avx2, avx512, amx",
             "'" + name + "'");
}

Tensor float_tensor(const std::vector<float>& values, std::vector<int64_t> shape) {
  Tensor t = at::empty(shape, at::kFloat);
  if (!values.empty())
    std::memcpy(t.data_ptr<float>(), values.data(), values.size() * sizeof(float));
  return t;
}

std::vector<int64_t> int64_values(const Tensor& t, const char* name) {
  if (t.scalar_type() != at::kLong && t.scalar_type() != at::kInt)
    rome::fail(rome::Status::invalid_argument, std::string(name) + ".dtype", "int32 or int64",
               c10::toString(t.scalar_type()));
  const Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

std::vector<double> double_values(const Tensor& t) {
  const Tensor c = t.to(at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

rt::Layout parse_layout(const std::string& layout) {
  if (layout == "half") return rt::Layout::half;
  if (layout == "pairs" || layout == "interleave") return rt::Layout::pairs;
  rome::fail(rome::Status::invalid_argument, "layout", "'half' or 'pairs' ('interleave')",
             "'" + layout + "'");
}

rt::Mrope parse_mrope(const std::string& mode) {
  if (mode == "sectioned") return rt::Mrope::sectioned;
  if (mode == "interleaved") return rt::Mrope::interleaved;
  rome::fail(rome::Status::invalid_argument, "mode", "'sectioned' or 'interleaved'",
             "'" + mode + "'");
}

py::tuple table_pair(const rt::Table& t) {
  return py::make_tuple(float_tensor(t.cos, {t.rows, t.width}),
                        float_tensor(t.sin, {t.rows, t.width}));
}

// (A, B) as [head_dim, head_dim] fp32: the rotary block top-left; past rotary_dim A is the
// identity and B is zero (pass-through lanes with C = 1, S = 0).
py::tuple rotation_matrices(const std::string& kind, int64_t rotary_dim,
                            const std::vector<int64_t>& blocks, int64_t head_dim) {
  if (head_dim == -1) head_dim = rotary_dim;
  const rome::Rotation r = rome_torch::build_rotation(kind, blocks, rotary_dim, head_dim,
                                                      std::nullopt, std::nullopt, "mat_b");
  const int64_t rd = r.rotary_dim(), hd = r.head_dim();
  Tensor a = at::eye(hd, at::kFloat), b = at::zeros({hd, hd}, at::kFloat);
  a.narrow(0, 0, rd).narrow(1, 0, rd).copy_(float_tensor(r.to_dense_a(), {rd, rd}));
  b.narrow(0, 0, rd).narrow(1, 0, rd).copy_(float_tensor(r.to_dense_b(), {rd, rd}));
  return py::make_tuple(a, b);
}

py::dict cpu_info() {
  py::dict d;
  d["detected_isa"] = rome::isa_name(rome::detected_isa());
  d["active_isa"] = rome::isa_name(rome::active_isa());
  py::list compiled;
  for (rome::Isa isa : {rome::Isa::scalar, rome::Isa::avx2, rome::Isa::avx512, rome::Isa::amx})
    if (rome::isa_compiled(isa)) compiled.append(rome::isa_name(isa));
  d["compiled_isas"] = compiled;
  d["default_num_threads"] = rome::default_num_threads();
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "RoME: fused rotary position embedding for CPUs (native part)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const rome::Error& e) {
      switch (e.status()) {
        case rome::Status::invalid_argument: PyErr_SetString(PyExc_ValueError, e.what()); break;
        case rome::Status::out_of_range: PyErr_SetString(PyExc_IndexError, e.what()); break;
        case rome::Status::unsupported: PyErr_SetString(PyExc_NotImplementedError, e.what()); break;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); break;
      }
    }
  });

  // CPU, ISA and threads.
  m.def("cpu_info", &cpu_info, "detected/active/compiled ISAs and the default thread count");
  m.def("active_isa", [] { return std::string(rome::isa_name(rome::active_isa())); });
  m.def("detected_isa", [] { return std::string(rome::isa_name(rome::detected_isa())); });
  m.def("isa_compiled",
        [](const std::string& name) { return rome::isa_compiled(parse_isa(name)); });
  m.def(
      "set_max_isa",
      [](const std::string& name) {
        return std::string(rome::isa_name(rome::set_max_isa(parse_isa(name))));
      },
      py::arg("isa"));
  m.def("set_num_threads", &rome::set_num_threads, py::arg("threads"));
  m.def("default_num_threads", &rome::default_num_threads);
  m.def("last_call_threads", &rome::last_call_threads,
        "distinct threads that ran this thread's last forward call (0: no work)");

  rome_torch::add_eager_entries(m);

  // Matrices.
  m.def("rotation_matrices", &rotation_matrices, py::arg("kind"), py::arg("rotary_dim"),
        py::arg("blocks") = std::vector<int64_t>{}, py::arg("head_dim") = -1);

  // Tables.
  using S = rt::Scaling;
  py::class_<S> scaling(m, "Scaling", "Frequency scaling (transformers' rope_type formulas)");
  py::enum_<S::Kind>(scaling, "Kind")
      .value("none", S::Kind::none)
      .value("linear", S::Kind::linear)
      .value("dynamic_ntk", S::Kind::dynamic_ntk)
      .value("ntk", S::Kind::ntk)
      .value("yarn", S::Kind::yarn)
      .value("llama3", S::Kind::llama3);
  scaling.def(py::init<>())
      .def_readwrite("kind", &S::kind)
      .def_readwrite("factor", &S::factor)
      .def_readwrite("original_max_position_embeddings", &S::original_max_position_embeddings)
      .def_readwrite("seq_len", &S::seq_len)
      .def_readwrite("beta_fast", &S::beta_fast)
      .def_readwrite("beta_slow", &S::beta_slow)
      .def_readwrite("mscale", &S::mscale)
      .def_readwrite("mscale_all_dim", &S::mscale_all_dim)
      .def_readwrite("attention_factor", &S::attention_factor)
      .def_readwrite("truncate", &S::truncate)
      .def_readwrite("low_freq_factor", &S::low_freq_factor)
      .def_readwrite("high_freq_factor", &S::high_freq_factor)
      .def_static("linear", &S::linear, py::arg("factor"))
      .def_static("dynamic_ntk", &S::dynamic_ntk, py::arg("factor"),
                  py::arg("max_position_embeddings"), py::arg("seq_len"))
      .def_static("ntk", &S::ntk, py::arg("factor"))
      .def_static("yarn", &S::yarn, py::arg("factor"), py::arg("original_max_position_embeddings"))
      .def_static("llama3", &S::llama3, py::arg("factor"),
                  py::arg("original_max_position_embeddings") = 8192,
                  py::arg("low_freq_factor") = 1.0, py::arg("high_freq_factor") = 4.0)
      .def("__repr__", [](const S& s) {
        static const char* names[] = {"none", "linear", "dynamic_ntk", "ntk", "yarn", "llama3"};
        return "rome.tables.Scaling(kind=" + std::string(names[int(s.kind)]) +
               ", factor=" + std::to_string(s.factor) + ")";
      });

  m.def(
      "inverse_frequencies",
      [](int64_t dim, double theta) {
        const auto f = rt::inverse_frequencies(dim, theta);
        return at::tensor(f, at::kDouble);
      },
      py::arg("dim"), py::arg("theta"));
  m.def(
      "scaled_frequencies",
      [](int64_t dim, double theta, const S& scaling) {
        const rt::Frequencies f = rt::scaled_frequencies(dim, theta, scaling);
        return py::make_tuple(at::tensor(f.inv_freq, at::kDouble), f.amplitude);
      },
      py::arg("dim"), py::arg("theta"), py::arg("scaling"));
  m.def(
      "rope_table",
      [](const Tensor& positions, const Tensor& inv_freq, const std::string& layout,
         double amplitude) {
        const auto pos = int64_values(positions, "positions");
        const auto f = double_values(inv_freq);
        return table_pair(
            rt::rope_table(std::span<const int64_t>(pos), f, parse_layout(layout), amplitude));
      },
      py::arg("positions"), py::arg("inv_freq"), py::arg("layout"), py::arg("amplitude") = 1.0);
  m.def(
      "frequency_table",
      [](int64_t num_positions, const Tensor& inv_freq, double amplitude) {
        return table_pair(rt::frequency_table(num_positions, double_values(inv_freq), amplitude));
      },
      py::arg("num_positions"), py::arg("inv_freq"), py::arg("amplitude") = 1.0);
  m.def(
      "cos_sin_cache",
      [](int64_t max_positions, const Tensor& inv_freq, double amplitude) {
        const rt::CosSinCache c =
            rt::cos_sin_cache(max_positions, double_values(inv_freq), amplitude);
        return float_tensor(c.data, {c.rows, c.width});
      },
      py::arg("max_positions"), py::arg("inv_freq"), py::arg("amplitude") = 1.0);
  m.def(
      "grid_table",
      [](const std::vector<int64_t>& dims, const std::vector<double>& thetas,
         const std::vector<int64_t>& sizes, const std::string& layout,
         const std::vector<int64_t>& starts) {
        return table_pair(
            rt::grid_table(rt::Axes{dims, thetas}, sizes, parse_layout(layout), starts));
      },
      py::arg("dims"), py::arg("thetas"), py::arg("sizes"), py::arg("layout"),
      py::arg("starts") = std::vector<int64_t>{});
  m.def(
      "axes_table",
      [](const std::vector<int64_t>& dims, const std::vector<double>& thetas,
         const Tensor& positions, const std::string& layout) {
        const auto pos = int64_values(positions, "positions");
        return table_pair(rt::axes_table(rt::Axes{dims, thetas}, pos, parse_layout(layout)));
      },
      py::arg("dims"), py::arg("thetas"), py::arg("positions"), py::arg("layout"));
  m.def(
      "mrope_table",
      [](const Tensor& positions, const Tensor& inv_freq, const std::vector<int64_t>& sections,
         const std::string& mode, double amplitude) {
        const auto pos = int64_values(positions, "positions");
        return table_pair(
            rt::mrope_table(pos, double_values(inv_freq), sections, parse_mrope(mode), amplitude));
      },
      py::arg("positions"), py::arg("inv_freq"), py::arg("sections"), py::arg("mode"),
      py::arg("amplitude") = 1.0);
  m.def(
      "mrope_column_axis",
      [](const std::vector<int64_t>& sections, const std::string& mode) {
        return rt::mrope_column_axis(sections, parse_mrope(mode));
      },
      py::arg("sections"), py::arg("mode"));
  m.def(
      "mrope_frequency_axis",
      [](const std::vector<int64_t>& sections, const std::string& mode) {
        return rt::mrope_frequency_axis(sections, parse_mrope(mode));
      },
      py::arg("sections"), py::arg("mode"));
}
