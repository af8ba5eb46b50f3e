// RoME: fused rotary position embedding for CPUs.
#pragma once

#include "rome/error.hpp"
#include "rome/fused.hpp"
#include "rome/rope.hpp"
#include "rome/rotation.hpp"
#include "rome/tables.hpp"
#include "rome/tensor.hpp"
