// Eager entries of rome::rope, rope_, rope_from_positions(_), rotary_embedding and the fused
// passes for calls outside torch.compile (rome.ops' wrappers and the drop-ins).
//
// A custom op called from Python goes through torch's generic path: each argument checked for
// __torch_function__, converted to an IValue against the schema, then the dispatcher's Autograd,
// ADInplaceOrView and CPU kernels. For one decode token that path is most of the call (5-6.5 µs
// here, 2.6-3.1 µs through this entry, a torch.add of the same q 1.9-2.9 µs; the kernel itself
// under 1 µs). The entries here make the CPU kernels' own calls (rope_call, ...: calls.hpp) when
// nothing else would have run on the way to them, and hand every other call
// to the op itself (`fallback`, with the same arguments), so their results, errors, autograd and
// version counters are the op's:
//   - every tensor argument is exactly torch.Tensor (no subclass and its __torch_function__), a
//     plain dense CPU tensor (its dispatch keys CPU, ADInplaceOrView, AutogradCPU, AutocastCPU at
//     most: no conjugate or negative bit, no Python, functorch or sparse keys);
//   - no torch function mode, no dispatch key forced on by this thread (Python dispatch modes,
//     functorch transforms), no profiler or other RecordFunction callback;
//   - no gradient to record: grad mode off, or no tensor requires grad;
//   - positional arguments of the schema's Python types (anything else: the op's error).
// Autocast on the CPU falls through for custom ops, so it changes nothing here. In place, the
// version counters of q and k are bumped as the op's ADInplaceOrView kernel does.
#include "eager.hpp"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <optional>
#include <type_traits>

#include "calls.hpp"

namespace rome_torch {
namespace {

namespace py = pybind11;

// The keys of a plain CPU tensor (an inference tensor has only CPU and AutocastCPU).
constexpr c10::DispatchKeySet kPlainCpuKeys({c10::DispatchKey::CPU,
                                             c10::DispatchKey::ADInplaceOrView,
                                             c10::DispatchKey::AutogradCPU,
                                             c10::DispatchKey::AutocastCPU});
// What a thread includes by default (and InferenceMode: BackendSelect alone).
constexpr c10::DispatchKeySet kDefaultIncluded({c10::DispatchKey::BackendSelect,
                                                c10::DispatchKey::ADInplaceOrView});

bool plain_cpu(const Tensor& t) {
  // Removing keys leaves backend bits: what stays must be the CPU bit alone.
  return t.is_cpu() && (t.key_set() - kPlainCpuKeys).raw_repr() ==
                           c10::DispatchKeySet(c10::BackendComponent::CPUBit).raw_repr();
}

bool thread_is_plain() {
  const auto tls = c10::impl::tls_local_dispatch_key_set();
  return (tls.included_ - kDefaultIncluded).empty() && !at::impl::torch_function_mode_enabled() &&
         !at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value();
}

// The arguments of one call, parsed from Python; false: not the fast path's (the op decides).
struct Reader {
  const py::args& args;
  std::size_t next = 0;
  bool grad = at::GradMode::is_enabled();

  PyObject* take() { return args[next++].ptr(); }

  bool tensor(const Tensor*& out) {
    PyObject* o = take();
    if (!THPVariable_CheckExact(o)) return false;
    out = &THPVariable_Unpack(o);
    return out->defined() && plain_cpu(*out) && !(grad && out->requires_grad());
  }
  bool optional_tensor(std::optional<Tensor>& out) {
    if (args[next].is_none()) {
      ++next;
      return true;
    }
    const Tensor* t = nullptr;
    if (!tensor(t)) return false;
    out = *t;
    return true;
  }
  bool text(c10::string_view& out) {
    PyObject* o = take();
    Py_ssize_t size = 0;
    const char* data = PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, &size) : nullptr;
    if (data == nullptr) {
      PyErr_Clear();
      return false;
    }
    out = c10::string_view(data, std::size_t(size));
    return true;
  }
  static bool integer(PyObject* o, int64_t& out) {
    if (!PyLong_CheckExact(o)) return false;  // not bool, not a tensor
    int overflow = 0;
    out = PyLong_AsLongLongAndOverflow(o, &overflow);
    return overflow == 0 && !(out == -1 && PyErr_Occurred());
  }
  bool integer(int64_t& out) { return integer(take(), out); }
  bool real(double& out) {  // a float (or an int, which the schema's float takes)
    PyObject* o = take();
    int64_t i = 0;
    if (PyFloat_CheckExact(o)) {
      out = PyFloat_AS_DOUBLE(o);
      return true;
    }
    if (!integer(o, i)) return false;
    out = double(i);
    return true;
  }
  bool flag(bool& out) {
    PyObject* o = take();
    if (!PyBool_Check(o)) return false;
    out = o == Py_True;
    return true;
  }
  bool integers(c10::SmallVector<int64_t, 8>& out) {
    PyObject* o = take();
    if (!PyTuple_CheckExact(o) && !PyList_CheckExact(o)) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    for (Py_ssize_t i = 0; i < n; ++i) {
      int64_t v = 0;
      if (!integer(items[i], v)) return false;
      out.push_back(v);
    }
    return true;
  }
};

using Written = c10::SmallVector<const Tensor*, 4>;

Written with_optional(const Tensor* t, const std::optional<Tensor>& u) {
  Written w{t};
  if (u) w.push_back(&*u);
  return w;
}

// rope / rope_'s arguments: (q, k, cos, sin, positions, rotation, blocks, rotary_dim,
// table_width, column_axis, mat_a, mat_b).
struct RopeArgs {
  const Tensor* q = nullptr;
  const Tensor* cos = nullptr;
  const Tensor* sin = nullptr;
  std::optional<Tensor> k, positions, mat_a, mat_b;
  c10::string_view rotation, table_width;
  c10::SmallVector<int64_t, 8> blocks, column_axis;
  int64_t rotary_dim = -1;

  static constexpr std::size_t kArity = 12;
  bool read(Reader& r) {
    return r.tensor(q) && r.optional_tensor(k) && r.tensor(cos) && r.tensor(sin) &&
           r.optional_tensor(positions) && r.text(rotation) && r.integers(blocks) &&
           r.integer(rotary_dim) && r.text(table_width) && r.integers(column_axis) &&
           r.optional_tensor(mat_a) && r.optional_tensor(mat_b);
  }
  int64_t bytes() const { return int64_t(q->nbytes() + (k ? k->nbytes() : 0)); }
  // What the in-place call writes (its version counters are bumped).
  Written written() const { return with_optional(q, k); }
};

// rope_from_positions / rope_from_positions_'s: (q, k, positions, inv_freq, rotation, blocks,
// rotary_dim, amplitude, column_axis, inverse).
struct FromPositionsArgs {
  const Tensor* q = nullptr;
  const Tensor* positions = nullptr;
  const Tensor* inv_freq = nullptr;
  std::optional<Tensor> k;
  c10::string_view rotation;
  c10::SmallVector<int64_t, 8> blocks, column_axis;
  int64_t rotary_dim = -1;
  double amplitude = 1.0;
  bool inverse = false;

  static constexpr std::size_t kArity = 10;
  bool read(Reader& r) {
    return r.tensor(q) && r.optional_tensor(k) && r.tensor(positions) && r.tensor(inv_freq) &&
           r.text(rotation) && r.integers(blocks) && r.integer(rotary_dim) && r.real(amplitude) &&
           r.integers(column_axis) && r.flag(inverse);
  }
  int64_t bytes() const { return int64_t(q->nbytes() + (k ? k->nbytes() : 0)); }
  // What the in-place call writes (its version counters are bumped).
  Written written() const { return with_optional(q, k); }
};

// rotary_embedding's (vLLM's contract, in place): (positions, query, key, head_size,
// cos_sin_cache, is_neox, rope_dim_offset, inverse).
struct RotaryEmbeddingArgs {
  const Tensor* positions = nullptr;
  const Tensor* query = nullptr;
  const Tensor* cos_sin_cache = nullptr;
  std::optional<Tensor> key;
  int64_t head_size = 0, rope_dim_offset = 0;
  bool is_neox = true, inverse = false;

  static constexpr std::size_t kArity = 8;
  bool read(Reader& r) {
    return r.tensor(positions) && r.tensor(query) && r.optional_tensor(key) &&
           r.integer(head_size) && r.tensor(cos_sin_cache) && r.flag(is_neox) &&
           r.integer(rope_dim_offset) && r.flag(inverse);
  }
  int64_t bytes() const { return int64_t(query->nbytes() + (key ? key->nbytes() : 0)); }
  // What the in-place call writes (its version counters are bumped).
  Written written() const { return with_optional(query, key); }
};

// fused_qk_norm_rope's (in place on qkv): (qkv, num_heads_q, num_heads_k, num_heads_v,
// head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox, position_ids, gemma_norm).
struct FusedQkNormRopeArgs {
  const Tensor* qkv = nullptr;
  const Tensor* q_weight = nullptr;
  const Tensor* k_weight = nullptr;
  const Tensor* cos_sin_cache = nullptr;
  const Tensor* position_ids = nullptr;
  int64_t heads_q = 0, heads_k = 0, heads_v = 0, head_dim = 0;
  double eps = 0;
  bool is_neox = true, gemma_norm = false;

  static constexpr std::size_t kArity = 12;
  bool read(Reader& r) {
    return r.tensor(qkv) && r.integer(heads_q) && r.integer(heads_k) && r.integer(heads_v) &&
           r.integer(head_dim) && r.real(eps) && r.tensor(q_weight) && r.tensor(k_weight) &&
           r.tensor(cos_sin_cache) && r.flag(is_neox) && r.tensor(position_ids) &&
           r.flag(gemma_norm);
  }
  int64_t bytes() const { return int64_t(qkv->nbytes()); }
  // What the in-place call writes (its version counters are bumped).
  Written written() const { return {qkv}; }
};

// rotary_embedding_with_cache's (query, key, key_cache, value_cache written): (positions, query,
// key, value, head_size, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping, q_weight,
// k_weight, eps, gemma_norm).
struct RopeWithCacheArgs {
  const Tensor* positions = nullptr;
  const Tensor* query = nullptr;
  const Tensor* key = nullptr;
  const Tensor* value = nullptr;
  const Tensor* cos_sin_cache = nullptr;
  const Tensor* key_cache = nullptr;
  const Tensor* value_cache = nullptr;
  const Tensor* slot_mapping = nullptr;
  std::optional<Tensor> q_weight, k_weight;
  int64_t head_size = 0;
  double eps = 0;
  bool is_neox = true, gemma_norm = false;

  static constexpr std::size_t kArity = 14;
  bool read(Reader& r) {
    return r.tensor(positions) && r.tensor(query) && r.tensor(key) && r.tensor(value) &&
           r.integer(head_size) && r.tensor(cos_sin_cache) && r.flag(is_neox) &&
           r.tensor(key_cache) && r.tensor(value_cache) && r.tensor(slot_mapping) &&
           r.optional_tensor(q_weight) && r.optional_tensor(k_weight) && r.real(eps) &&
           r.flag(gemma_norm);
  }
  int64_t bytes() const { return int64_t(query->nbytes() + key->nbytes() + value->nbytes()); }
  // What the in-place call writes (its version counters are bumped).
  Written written() const { return {query, key, key_cache, value_cache}; }
};

void bump_unless_inference(const Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}

// Calls this thread's entries ran themselves and handed to the op (tests read them).
thread_local int64_t direct_calls = 0, fallback_calls = 0;

// The GIL is let go (as the op does) for calls long enough that other Python threads should run
// meanwhile; for a decode token, taking it back cost about 0.2 µs of a 4.5 µs call.
constexpr int64_t kReleaseGilBytes = int64_t(1) << 16;

struct MaybeReleaseGil {
  template <typename Args>
  explicit MaybeReleaseGil(const Args& a) : released(a.bytes() > kReleaseGilBytes) {
    if (released) state = PyEval_SaveThread();
  }
  ~MaybeReleaseGil() {
    if (released) PyEval_RestoreThread(state);
  }
  bool released;
  PyThreadState* state = nullptr;
};

// Registers `name`, which given the op's C++ entry (`fallback`) returns the eager entry: `call(a)`
// with the GIL let go for long calls where the arguments are the fast path's, else
// `fallback(*args, **kwargs)`. A `call` returning nothing is in place: the tensors it wrote get
// their version counters bumped, as the op's ADInplaceOrView kernel does.
template <typename Args, typename Call>
void def_entry(py::module_& m, const char* name, const char* doc, Call call) {
  auto make = [call](py::object fallback) {
    return py::cpp_function([fallback, call](py::args args, py::kwargs kwargs) -> py::object {
      Args a;
      Reader reader{args};
      if (args.size() != Args::kArity || kwargs.size() != 0 || !thread_is_plain() ||
          !a.read(reader)) {
        ++fallback_calls;
        return fallback(*args, **kwargs);
      }
      ++direct_calls;
      if constexpr (std::is_void_v<decltype(call(a))>) {
        {
          MaybeReleaseGil gil(a);
          call(a);
        }
        for (const Tensor* t : a.written()) bump_unless_inference(*t);
        return py::none();
      } else {
        decltype(call(a)) out;
        {
          MaybeReleaseGil gil(a);
          out = call(a);
        }
        return py::cast(std::move(out));
      }
    });
  };
  m.def(name, make, py::arg("fallback"), doc);
}

}  // namespace

void add_eager_entries(py::module_& m) {
  const char* doc = "an op's eager entry (eager.cpp), given the op's own (`fallback`)";
  def_entry<RopeArgs>(m, "_eager_rope", doc, [](const RopeArgs& a) {
    return rope_call(Mode::run, *a.q, a.k, *a.cos, *a.sin, a.positions, a.rotation, a.blocks,
                     a.rotary_dim, a.table_width, a.column_axis, a.mat_a, a.mat_b);
  });
  def_entry<RopeArgs>(m, "_eager_rope_", doc, [](const RopeArgs& a) {
    rope_inplace_call(Mode::run, *a.q, a.k, *a.cos, *a.sin, a.positions, a.rotation, a.blocks,
                      a.rotary_dim, a.table_width, a.column_axis, a.mat_a, a.mat_b);
  });
  def_entry<FromPositionsArgs>(
      m, "_eager_rope_from_positions", doc, [](const FromPositionsArgs& a) {
        return rope_from_positions_call(Mode::run, *a.q, a.k, *a.positions, *a.inv_freq, a.rotation,
                                        a.blocks, a.rotary_dim, a.amplitude, a.column_axis,
                                        a.inverse);
      });
  def_entry<FromPositionsArgs>(
      m, "_eager_rope_from_positions_", doc, [](const FromPositionsArgs& a) {
        rope_from_positions_inplace_call(Mode::run, *a.q, a.k, *a.positions, *a.inv_freq,
                                         a.rotation, a.blocks, a.rotary_dim, a.amplitude,
                                         a.column_axis, a.inverse);
      });
  def_entry<RotaryEmbeddingArgs>(
      m, "_eager_rotary_embedding", doc, [](const RotaryEmbeddingArgs& a) {
        rotary_embedding_call(Mode::run, *a.positions, *a.query, a.key, a.head_size,
                              *a.cos_sin_cache, a.is_neox, a.rope_dim_offset, a.inverse);
      });
  def_entry<FusedQkNormRopeArgs>(
      m, "_eager_fused_qk_norm_rope", doc, [](const FusedQkNormRopeArgs& a) {
        fused_qk_norm_rope_call(Mode::run, *a.qkv, a.heads_q, a.heads_k, a.heads_v, a.head_dim,
                                a.eps, *a.q_weight, *a.k_weight, *a.cos_sin_cache, a.is_neox,
                                *a.position_ids, a.gemma_norm);
      });
  def_entry<RopeWithCacheArgs>(
      m, "_eager_rotary_embedding_with_cache", doc, [](const RopeWithCacheArgs& a) {
        rotary_embedding_with_cache_call(Mode::run, *a.positions, *a.query, *a.key, *a.value,
                                         a.head_size, *a.cos_sin_cache, a.is_neox, *a.key_cache,
                                         *a.value_cache, *a.slot_mapping, a.q_weight, a.k_weight,
                                         a.eps, a.gemma_norm);
      });
  m.def(
      "_eager_counts",
      [] {
        return std::pair{direct_calls, fallback_calls};
      },
      "(calls run by the eager entries themselves, calls handed to the op) on this thread");
}

}  // namespace rome_torch
