// One test per validation error: the message names the argument, what was expected and what was
// given, and no output byte changes.
#include <gtest/gtest.h>

#include <climits>
#include <functional>
#include <random>

#include "reference.hpp"
#include "rome/rome.hpp"

namespace rome::testing {
namespace {

// A valid call (x [2, 3, 4, 8] bf16, half rotation, tables [4, 8] fp32) that each test breaks
// in one way.
struct Call {
  Rotation rotation = Rotation::half(8);
  TestTensor x = TestTensor::make(DType::bf16, {2, 3, 4, 8});
  TestTensor out = TestTensor::make(DType::bf16, {2, 3, 4, 8});
  TestTensor k = TestTensor::make(DType::bf16, {2, 1, 4, 8});
  TestTensor k_out = TestTensor::make(DType::bf16, {2, 1, 4, 8});
  TestTables tables;
  ConstTensorView x_view;
  TensorView out_view;
  Tables t;
  bool with_k = false;
  ConstTensorView k_view;
  TensorView k_out_view;

  Call() {
    std::mt19937_64 rng(3);
    x.fill_random(rng, -1, 1);
    k.fill_random(rng, -1, 1);
    tables.cos = TestTensor::make(DType::f32, {4, 8});
    tables.sin = TestTensor::make(DType::f32, {4, 8});
    tables.cos.fill_random(rng, -1, 1);
    tables.sin.fill_random(rng, -1, 1);
    x_view = x.cview();
    out_view = out.view();
    k_view = k.cview();
    k_out_view = k_out.view();
    t = tables.view();
  }
  void use_cache(DType positions_dtype, std::int64_t cache_rows) {
    tables.cos = TestTensor::make(DType::f32, {cache_rows, 8});
    tables.sin = TestTensor::make(DType::f32, {cache_rows, 8});
    tables.cos.fill([](const auto&) { return 0.5; });
    tables.sin.fill([](const auto&) { return 0.25; });
    tables.positions = TestTensor::make(positions_dtype, {2, 1, 4});
    tables.positions.fill([&](const auto& i) { return double(i[2] % cache_rows); });
    t = tables.view();
  }
  // rope_check with every data pointer null: it must decide from shapes, dtypes and strides.
  void check_without_data() const {
    ConstTensorView xv = x_view, kv = k_view;
    TensorView ov = out_view, kov = k_out_view;
    Tables tv = t;
    xv.data = kv.data = tv.cos.data = tv.sin.data = nullptr;
    ov.data = kov.data = nullptr;
    if (tv.is_cache()) tv.positions.data = nullptr;
    const Operand ko{kv, kov};
    rope_check(rotation, tv, Operand{xv, ov}, with_k ? &ko : nullptr);
  }
  void run() {
    if (with_k) {
      const Operand ko{k_view, k_out_view};
      rope_forward(rotation, t, Operand{x_view, out_view}, &ko);
    } else {
      rope_forward(rotation, t, Operand{x_view, out_view});
    }
  }
};

// Where an error's cause lies: in shapes, dtypes and strides (rope_check, which reads no memory,
// must raise the very same error), or in memory (pointers, aliasing, position values: rope_check
// must accept the call and leave it to rope_forward).
enum class Cause { metadata, memory };

// Runs the call, expects rome::Error with `status` naming `argument` and containing every piece
// of `fragments`, and checks that no output was written; then rope_check as `cause` says.
void expect_error(Call& call, Status status, const std::string& argument,
                  std::initializer_list<std::string> fragments, Cause cause = Cause::metadata) {
  std::string forward_message;
  const auto out_before = call.out.storage, x_before = call.x.storage, k_before = call.k.storage,
             k_out_before = call.k_out.storage;
  try {
    call.run();
    ADD_FAILURE() << "no error raised; expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    const std::string message = e.what();
    EXPECT_NE(message.find("rome: " + argument + ": expected "), std::string::npos) << message;
    EXPECT_NE(message.find(", got "), std::string::npos) << message;
    for (const auto& f : fragments)
      EXPECT_NE(message.find(f), std::string::npos) << message << " lacks " << f;
    forward_message = message;
  }
  if (cause == Cause::memory) {
    EXPECT_NO_THROW(call.check_without_data()) << "rope_check refused a call for its memory";
  } else {
    try {
      call.check_without_data();
      ADD_FAILURE() << "rope_check raised nothing; rope_forward: " << forward_message;
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), status) << e.what();
      EXPECT_EQ(std::string(e.what()), forward_message);
    }
  }
  EXPECT_EQ(out_before, call.out.storage) << "out written on error";
  EXPECT_EQ(x_before, call.x.storage) << "x written on error";
  EXPECT_EQ(k_before, call.k.storage) << "k written on error";
  EXPECT_EQ(k_out_before, call.k_out.storage) << "k_out written on error";
}

TEST(Validation, ValidCallSucceeds) {
  Call c;
  EXPECT_NO_THROW(c.run());
  EXPECT_NO_THROW(c.check_without_data());
  c.with_k = true;
  c.use_cache(DType::i32, 4);
  EXPECT_NO_THROW(c.run());
  EXPECT_NO_THROW(c.check_without_data());
  c.rotation = Rotation::half(4).partial(8, 2);  // a lane offset: checked on the narrowed heads
  c.tables.cos = TestTensor::make(DType::f32, {4, 4});
  c.tables.sin = TestTensor::make(DType::f32, {4, 4});
  c.t = c.tables.view();
  EXPECT_NO_THROW(c.check_without_data());
}
// A binding names the core's operands after its own arguments: the message is formed again from
// the error's parts, with status, expected and given kept.
TEST(Validation, ErrorAboutAnotherArgumentKeepsItsParts) {
  try {
    fail(Status::out_of_range, "q.dtype", "bfloat16, float16 or float32", "int32");
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rome: q.dtype: expected bfloat16, float16 or float32, got int32");
    const Error renamed = e.about("x.dtype");
    EXPECT_EQ(renamed.status(), Status::out_of_range);
    EXPECT_EQ(renamed.argument(), "x.dtype");
    EXPECT_EQ(renamed.expected(), e.expected());
    EXPECT_EQ(renamed.given(), "int32");
    EXPECT_STREQ(renamed.what(), "rome: x.dtype: expected bfloat16, float16 or float32, got int32");
    return;
  }
  FAIL() << "fail() did not throw";
}
TEST(Validation, RankTooSmall) {
  Call c;
  c.x_view.rank = 1;
  expect_error(c, Status::invalid_argument, "q", {"rank 2 to 5", "rank 1"});
}
TEST(Validation, RankTooLarge) {
  Call c;
  c.x_view.rank = 6;
  expect_error(c, Status::invalid_argument, "q", {"rank 2 to 5", "rank 6"});
}
TEST(Validation, NegativeSize) {
  Call c;
  c.x_view.shape[0] = -2;
  expect_error(c, Status::invalid_argument, "q", {"non-negative", "[-2, 3, 4, 8]"});
}
TEST(Validation, ElementCountOverflow) {
  Call c;
  c.x_view.shape[0] = c.x_view.shape[1] = std::int64_t(1) << 30;
  expect_error(c, Status::out_of_range, "q", {"2^60"});
}
TEST(Validation, IntegerDtype) {
  Call c;
  c.x_view.dtype = DType::i32;
  expect_error(c, Status::invalid_argument, "q.dtype", {"float32, float16 or bfloat16", "int32"});
}
TEST(Validation, HeadDimMismatch) {
  Call c;
  c.rotation = Rotation::half(6);
  expect_error(c, Status::invalid_argument, "q", {"last axis of 6", "[2, 3, 4, 8]"});
}
TEST(Validation, NullData) {
  Call c;
  c.x_view.data = nullptr;
  expect_error(c, Status::invalid_argument, "q", {"data pointer", "null"}, Cause::memory);
}
// A pointer one byte past an element boundary (x is bf16: 2-byte elements). The storage is
// copied one byte along so the view still covers valid memory and ASan sees real reads.
TEST(Validation, MisalignedData) {
  Call c;
  std::vector<unsigned char> bytes(c.x.storage.size() + 1);
  c.x_view.data = bytes.data() + 1;
  expect_error(c, Status::invalid_argument, "q", {"aligned to 2 bytes", "bfloat16", "address 0x"},
               Cause::memory);
}
TEST(Validation, MisalignedOutput) {
  Call c;
  std::vector<unsigned char> bytes(c.out.storage.size() + 1);
  c.out_view.data = bytes.data() + 1;
  const auto before = bytes;
  expect_error(c, Status::invalid_argument, "q_out", {"aligned to 2 bytes"}, Cause::memory);
  EXPECT_EQ(before, bytes);
}
TEST(Validation, MisalignedTable) {
  Call c;
  std::vector<unsigned char> bytes(c.tables.sin.storage.size() + 2);
  c.t.sin.data = bytes.data() + 2;
  expect_error(c, Status::invalid_argument, "sin", {"aligned to 4 bytes", "float32"},
               Cause::memory);
}
TEST(Validation, MisalignedPositions) {
  Call c;
  c.use_cache(DType::i64, 4);
  std::vector<unsigned char> bytes(c.tables.positions.storage.size() + 4);
  c.t.positions.data = bytes.data() + 4;  // int64 at a 4-byte boundary
  expect_error(c, Status::invalid_argument, "positions", {"aligned to 8 bytes", "int64"},
               Cause::memory);
}
TEST(Validation, NonContiguousHeadAxis) {
  Call c;
  c.x_view.strides[3] = 2;
  expect_error(c, Status::invalid_argument, "q", {"stride 1", "stride 2"});
}
TEST(Validation, StrideExtentOverflow) {
  Call c;
  c.x_view.strides[0] = std::int64_t(1) << 61;
  expect_error(c, Status::out_of_range, "q", {"strides"});
}
TEST(Validation, OutputDtypeMismatch) {
  Call c;
  c.out_view.dtype = DType::f16;
  expect_error(c, Status::invalid_argument, "q_out.dtype", {"bfloat16", "float16"});
}
TEST(Validation, OutputShapeMismatch) {
  Call c;
  c.out_view.shape[2] = 3;
  expect_error(c, Status::invalid_argument, "q_out", {"[2, 3, 4, 8]", "[2, 3, 3, 8]"});
}
TEST(Validation, OutputWithRepeatedElements) {
  Call c;
  c.out_view.strides[1] = 0;
  expect_error(c, Status::invalid_argument, "q_out", {"its own address"});
}
TEST(Validation, PartialOverlapOfInputAndOutput) {
  Call c;
  TensorView shifted = c.x.view();
  shifted.data = static_cast<char*>(shifted.data) + 2 * 8;  // one row further
  shifted.shape[0] = 2;
  c.out_view = shifted;
  c.out_view.data = static_cast<std::uint16_t*>(c.x.view().data) + 8;
  expect_error(c, Status::invalid_argument, "q_out", {"partial overlap"}, Cause::memory);
}
// Empty views touch no memory, even where an axis before the empty one steps backwards (their
// span once came out as the bytes below the data pointer: fuzz_rope found dx reported as
// overlapping x). The forward skips empty operands before its overlap test; the backward tests
// its outputs against x, so it runs here: x and dx empty [2, 0, 4, 8] views of one buffer.
TEST(Validation, EmptyViewsWithNegativeStridesDoNotOverlap) {
  TestTensor buffer = TestTensor::make(DType::f32, {2, 3, 4, 8});
  TestTables tables;
  tables.cos = TestTensor::make(DType::f32, {4, 8});
  tables.sin = TestTensor::make(DType::f32, {4, 8});
  tables.cos.fill([](const auto&) { return 0.5; });
  tables.sin.fill([](const auto&) { return 0.25; });
  auto* base = static_cast<float*>(buffer.view().data);
  ConstTensorView x = buffer.cview();
  x.shape[1] = 0;
  x.strides[0] = -x.strides[0];
  x.data = base + 96;  // the axis of 2 would reach back to base
  Gradients g;
  g.dx = buffer.view();
  g.dx.shape[1] = 0;
  g.dx.strides[0] = -g.dx.strides[0];
  g.dx.data = base + 104;
  TestTensor dcos = TestTensor::make(DType::f32, {4, 8}), dsin = dcos;
  g.dcos = dcos.view();  // table gradients: x is read, and dx is tested against it
  g.dsin = dsin.view();
  const auto before = buffer.storage;
  EXPECT_NO_THROW(rope_backward(Rotation::half(8), tables.view(), x, x, g));
  EXPECT_EQ(before, buffer.storage);
}
TEST(Validation, KRankMismatch) {
  Call c;
  c.with_k = true;
  c.k_view.rank = c.k_out_view.rank = 3;
  c.k_view.shape[2] = c.k_out_view.shape[2] = 8;
  c.k_view.strides[2] = c.k_out_view.strides[2] = 1;
  expect_error(c, Status::invalid_argument, "k", {"rank 4 (the rank of q)", "rank 3"});
}
TEST(Validation, KDtypeMismatch) {
  Call c;
  c.with_k = true;
  c.k_view.dtype = c.k_out_view.dtype = DType::f16;
  expect_error(c, Status::invalid_argument, "k.dtype", {"bfloat16", "float16"});
}
TEST(Validation, KOutputOverlapsQOutput) {
  Call c;
  c.with_k = true;
  c.k_out_view.data = c.out_view.data;
  c.k_out_view.strides[0] = c.out_view.strides[0];
  expect_error(c, Status::invalid_argument, "k_out", {"disjoint from q_out"}, Cause::memory);
}
TEST(Validation, KOutputOverlapsQ) {
  Call c;
  c.with_k = true;
  c.k_out_view.data = const_cast<void*>(c.x_view.data);
  expect_error(c, Status::invalid_argument, "k_out", {"disjoint from q"}, Cause::memory);
}
TEST(Validation, QOutputOverlapsK) {
  Call c;
  c.with_k = true;
  // q_out is exactly k's memory (same shape and strides): k is read while q_out is written.
  c.out_view.data = const_cast<void*>(c.k_view.data);
  c.out_view.shape[1] = 1;
  c.x_view.shape[1] = 1;
  for (int i = 0; i < 4; ++i) c.out_view.strides[i] = c.k_view.strides[i];
  expect_error(c, Status::invalid_argument, "q_out", {"disjoint from k"}, Cause::memory);
}
TEST(Validation, KSizeDiffersWhereTablesVary) {
  Call c;
  c.with_k = true;
  c.k_view.shape[2] = c.k_out_view.shape[2] = 3;
  expect_error(c, Status::invalid_argument, "cos", {"broadcastable to k"});
}
TEST(Validation, KBatchDiffersAlongTableAxis) {
  Call c;
  c.with_k = true;
  c.tables.cos = TestTensor::make(DType::f32, {2, 1, 4, 8});
  c.tables.sin = TestTensor::make(DType::f32, {2, 1, 4, 8});
  c.tables.cos.fill([](const auto&) { return 1.0; });
  c.tables.sin.fill([](const auto&) { return 0.0; });
  c.t = c.tables.view();
  c.k = TestTensor::make(DType::bf16, {1, 1, 4, 8});
  c.k_out = TestTensor::make(DType::bf16, {1, 1, 4, 8});
  c.k_view = c.k.cview();
  c.k_out_view = c.k_out.view();
  expect_error(c, Status::invalid_argument, "cos",
               {"broadcastable to k [1, 1, 4, 8]", "[2, 1, 4, 8]"});
}
TEST(Validation, TableRank) {
  Call c;
  c.t.cos.rank = 0;
  expect_error(c, Status::invalid_argument, "cos", {"rank 1 to 5", "rank 0"});
}
TEST(Validation, TableDtype) {
  Call c;
  c.t.sin.dtype = DType::i64;
  expect_error(c, Status::invalid_argument, "sin.dtype", {"float32", "int64"});
}
TEST(Validation, TableWidth) {
  Call c;
  c.t.width = TableWidth::halves;
  expect_error(c, Status::invalid_argument, "cos", {"last axis of 4", "halves width", "[4, 8]"});
}
TEST(Validation, TableNullData) {
  Call c;
  c.t.cos.data = nullptr;
  expect_error(c, Status::invalid_argument, "cos", {"data pointer", "null"}, Cause::memory);
}
TEST(Validation, SinShapeDiffersFromCos) {
  Call c;
  c.t.sin.shape[0] = 1;
  expect_error(c, Status::invalid_argument, "sin", {"the shape of cos [4, 8]", "[1, 8]"});
}
TEST(Validation, TableNotBroadcastable) {
  Call c;
  c.t.cos.shape[0] = c.t.sin.shape[0] = 3;
  expect_error(c, Status::invalid_argument, "cos", {"broadcastable to q [2, 3, 4, 8]", "[3, 8]"});
}
TEST(Validation, TableHasMoreAxesThanX) {
  Call c;
  c.x_view.rank = c.out_view.rank = 2;
  c.x_view.shape[0] = c.out_view.shape[0] = 1;
  c.x_view.shape[1] = c.out_view.shape[1] = 8;
  c.x_view.strides[1] = c.out_view.strides[1] = 1;
  c.t.cos.rank = c.t.sin.rank = 3;
  c.t.cos.shape[0] = c.t.sin.shape[0] = 1;
  c.t.cos.shape[1] = c.t.sin.shape[1] = 1;
  c.t.cos.shape[2] = c.t.sin.shape[2] = 8;
  c.t.cos.strides[2] = c.t.sin.strides[2] = 1;
  expect_error(c, Status::invalid_argument, "cos", {"at most 1 axes"});
}
TEST(Validation, ColumnAxisWithDirectTables) {
  Call c;
  c.t.column_axis = {0, 0, 0, 0, 0, 0, 0, 0};
  expect_error(c, Status::invalid_argument, "tables.column_axis", {"empty for direct tables"});
}
TEST(Validation, CacheMustBeRank2) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.t.cos = c.t.sin = c.x_view;
  c.t.cos.dtype = c.t.sin.dtype = DType::bf16;
  expect_error(c, Status::invalid_argument, "cos", {"[P, width] cache"});
}
TEST(Validation, PositionsDtype) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.t.positions.dtype = DType::f32;
  expect_error(c, Status::invalid_argument, "positions.dtype", {"int32 or int64", "float32"});
}
TEST(Validation, PositionsRank) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.t.positions.rank = 2;
  expect_error(c, Status::invalid_argument, "positions", {"rank 3", "rank 2"});
}
TEST(Validation, PositionsNotBroadcastable) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.t.positions.shape[1] = 2;
  expect_error(c, Status::invalid_argument, "positions", {"broadcastable to q"});
}
TEST(Validation, PositionPastCacheEnd) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.tables.positions.set({1, 0, 3}, 4);
  expect_error(c, Status::out_of_range, "positions", {"values in [0, 4)", "4 at index [1, 0, 3]"},
               Cause::memory);
}
TEST(Validation, NegativePosition) {
  Call c;
  c.use_cache(DType::i32, 4);
  c.tables.positions.set({0, 0, 2}, -1);
  expect_error(c, Status::out_of_range, "positions", {"-1 at index [0, 0, 2]"}, Cause::memory);
}
TEST(Validation, HugePositionDoesNotWrap) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.tables.positions.set({0, 0, 0}, double(std::int64_t(1) << 40));
  expect_error(c, Status::out_of_range, "positions", {"1099511627776"}, Cause::memory);
}
TEST(Validation, PositionsNull) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.t.positions.data = nullptr;  // a shape without data is a broken cache, not direct tables
  expect_error(c, Status::invalid_argument, "positions", {"data pointer", "null"}, Cause::memory);
}
TEST(Validation, TableWidthOutsideEnum) {
  Call c;
  c.t.width = static_cast<TableWidth>(7);
  expect_error(c, Status::invalid_argument, "tables.width", {"full, halves or pairs", "7"});
}
TEST(Validation, OutputOverlapsPositions) {
  // Writing q_out over the positions would change rows still to be gathered.
  Call c;
  c.use_cache(DType::i32, 4);
  TestTensor& pos = c.tables.positions;
  c.out_view.data = pos.storage.data();
  c.out_view.dtype = DType::bf16;
  expect_error(c, Status::invalid_argument, "q_out", {"disjoint from positions"}, Cause::memory);
}
TEST(Validation, OutputOverlapsTables) {
  Call c;
  c.out_view.data = c.tables.cos.storage.data();
  expect_error(c, Status::invalid_argument, "q_out", {"disjoint from cos"}, Cause::memory);
}
TEST(Validation, MinimumStride) {
  Call c;
  c.x_view.strides[0] = INT64_MIN;
  expect_error(c, Status::out_of_range, "q", {"strides"});
}
TEST(Validation, HugeStrideOnSizeOnePositionsAxis) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.t.positions.strides[1] = INT64_MAX;  // axis of size 1: never stepped, any stride allowed
  EXPECT_NO_THROW(c.run());
}
TEST(Validation, ThreadCountOption) {
  Call c;
  const auto before = c.out.storage;
  try {
    rope_forward(c.rotation, c.t, Operand{c.x_view, c.out_view}, nullptr, ExecOptions{1 << 20});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "options.num_threads");
  }
  EXPECT_EQ(before, c.out.storage);
}
TEST(Validation, ColumnAxisSize) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.tables.positions = TestTensor::make(DType::i64, {2, 1, 4, 3});
  c.tables.positions.fill([](const auto&) { return 1.0; });
  c.t = c.tables.view();
  c.t.column_axis = {0, 1, 2};
  expect_error(c, Status::invalid_argument, "tables.column_axis", {"8 entries", "3"});
}
TEST(Validation, ColumnAxisEntry) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.tables.positions = TestTensor::make(DType::i64, {2, 1, 4, 3});
  c.tables.positions.fill([](const auto&) { return 1.0; });
  c.t = c.tables.view();
  c.t.column_axis = {0, 1, 2, 0, 1, 2, 3, 0};
  expect_error(c, Status::invalid_argument, "tables.column_axis", {"[0, 3)", "3 at column 6"});
}
TEST(Validation, EmptyCache) {
  Call c;
  c.use_cache(DType::i64, 4);
  c.t.cos.shape[0] = c.t.sin.shape[0] = 0;
  expect_error(c, Status::invalid_argument, "cos", {"at least one row"});
}

// Errors of the rotation builders.
void expect_builder_error(const std::function<void()>& f, const std::string& argument,
                          const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no error for " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(RotationValidation, Builders) {
  expect_builder_error([] { Rotation::half(7); }, "dim", "got 7");
  expect_builder_error([] { Rotation::half(0); }, "dim", "got 0");
  expect_builder_error([] { Rotation::quarter(6); }, "dim", "multiple of 4");
  expect_builder_error([] { Rotation::dense(std::vector<float>(15), 4); }, "b", "got 15 values");
  expect_builder_error([] { Rotation::dense(std::vector<float>(9), 3); }, "dim", "got 3");
  expect_builder_error(
      [] {
        std::vector<float> m(16, 0.0f);
        m[5] = NAN;
        Rotation::dense(m, 4);
      },
      "b", "NaN or infinite");
  expect_builder_error([] { Rotation::block_diag(std::span<const Rotation>{}); }, "blocks", "none");
  expect_builder_error([] { Rotation::half(8).partial(6); }, "head_dim", "got 6");
  expect_builder_error([] { Rotation::half(8).partial(16).partial(32); }, "rotation",
                       "already partial");
  expect_builder_error(
      [] {
        Rotation::block_diag({Rotation::half(8).partial(16), Rotation::half(8)});
      },
      "blocks[0]", "partial");
  expect_builder_error([] { set_num_threads(-1); }, "threads", "got -1");
}

// Backward arguments.
TEST(Validation, BackwardTableGradientOfCache) {
  Call c;
  c.use_cache(DType::i64, 4);
  TestTensor dcos = TestTensor::make(DType::f32, {4, 8});
  Gradients g;
  g.dcos = dcos.view();
  try {
    rope_backward(c.rotation, c.t, c.x_view, c.x_view, g);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::unsupported);
    EXPECT_EQ(e.argument(), "dcos");
  }
}
TEST(Validation, BackwardXShape) {
  Call c;
  TestTensor dx = TestTensor::make(DType::bf16, {2, 3, 4, 8});
  TestTensor dcos = TestTensor::make(DType::f32, {4, 8});
  const auto before = dx.storage;
  Gradients g;
  g.dx = dx.view();
  g.dcos = dcos.view();
  ConstTensorView x = c.x_view;
  x.shape[0] = 1;
  EXPECT_THROW(rope_backward(c.rotation, c.t, c.x_view, x, g), Error);
  EXPECT_EQ(before, dx.storage);
}
TEST(Validation, BackwardOutputsMustNotOverlapInputs) {
  Call c;
  TestTensor dcos = TestTensor::make(DType::f32, {4, 8});
  Gradients g;
  g.dx = c.x.view();  // dx over x: x is still read for dcos
  g.dcos = dcos.view();
  try {
    rope_backward(c.rotation, c.t, c.out.cview(), c.x_view, g);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "dx");
  }
  Gradients same;
  same.dcos = same.dsin = dcos.view();
  try {
    rope_backward(c.rotation, c.t, c.x_view, c.x_view, same);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "dsin");
    EXPECT_NE(std::string(e.what()).find("disjoint from dcos"), std::string::npos);
  }
}
TEST(Validation, BackwardMisalignedMatrixGradient) {
  Call c;
  c.rotation = Rotation::dense(std::vector<float>(64, 0.5f), 8);
  std::vector<float> storage(65, -1.0f);
  Gradients g;
  g.db = reinterpret_cast<float*>(reinterpret_cast<char*>(storage.data()) + 2);
  try {
    rope_backward(c.rotation, c.t, c.x_view, c.x_view, g);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "db");
    EXPECT_NE(std::string(e.what()).find("aligned to 4 bytes"), std::string::npos) << e.what();
  }
  for (float v : storage) EXPECT_EQ(v, -1.0f);
}
TEST(Validation, BackwardOfEmptyTensor) {
  Call c;
  TestTensor g = TestTensor::make(DType::bf16, {0, 4, 8}),
             dx = TestTensor::make(DType::bf16, {0, 4, 8});
  TestTensor dcos = TestTensor::make(DType::f32, {4, 8});
  Gradients out;
  out.dx = dx.view();
  out.dcos = dcos.view();
  EXPECT_NO_THROW(rope_backward(c.rotation, c.t, g.cview(), g.cview(), out));
  for (std::int64_t e = 0; e < dcos.numel(); ++e) EXPECT_EQ(dcos.get(dcos.unravel(e)), 0.0);
}
TEST(Validation, BackwardTableGradientShape) {
  Call c;
  TestTensor dcos = TestTensor::make(DType::f32, {5, 8});
  Gradients g;
  g.dcos = dcos.view();
  try {
    rope_backward(c.rotation, c.t, c.x_view, c.x_view, g);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "dcos");
    EXPECT_NE(std::string(e.what()).find("the shape of cos [4, 8]"), std::string::npos);
  }
}

}  // namespace
}  // namespace rome::testing
